"""kvstage.sim: the deterministic simulator that runs the real protocol endpoints through seeded faults.

Owns the simulated world and everything it needs: its event loop (world.py), built from parts that share one
state (core.py): the engine models (engines.py) and the data plane (dataplane.py), with their records and
timing model (records.py); a virtual clock, event kinds and event queue (clock.py), a faulty network
(network.py), fault levels (faults.py), seeded scenarios (scenario.py), memory with ownership tags (memory.py),
hostile frames (hostile.py), the invariant checker (invariants.py), traces (trace.py), the multi-seed runner
(runner.py) and the `kvstage sim` output (console.py). docs/simulation.md describes it.

Imports protocol/, layout, ring and numpy; never runtime/ and never a real clock inside a world. A seed fully
determines a run: `kvstage sim --seed N --trace` replays it exactly.
"""

from kvstage.sim.faults import FAULT_LEVELS, FaultProfile
from kvstage.sim.invariants import Violation
from kvstage.sim.runner import Summary, run_seed, run_seeds
from kvstage.sim.scenario import SimConfig
from kvstage.sim.world import RunResult, World

__all__ = [
    "FAULT_LEVELS",
    "FaultProfile",
    "RunResult",
    "SimConfig",
    "Summary",
    "Violation",
    "World",
    "run_seed",
    "run_seeds",
]
