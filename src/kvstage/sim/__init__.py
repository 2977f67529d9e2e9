"""kvstage.sim: the deterministic simulator that runs the real protocol endpoints through seeded faults.

Owns the simulated world and everything it needs. Its modules form a line, each importing only modules below it:

1. the leaves: a virtual clock, event kinds and event queue (clock.py), fault levels (faults.py), memory with
   ownership tags (memory.py), traces (trace.py), hostile frames (hostile.py); above them seeded scenarios
   (scenario.py) and a faulty network (network.py);
2. the plain records and the timing model (records.py), `Violation` among them;
3. the invariant checker (invariants.py), which reads the world only through `WorldView`, a read-only view it
   defines;
4. the state the world's parts share (core.py), then the parts: the engine models (engines.py) and the data
   plane (dataplane.py);
5. the world and its event loop (world.py);
6. the multi-seed runner (runner.py) and the `kvstage sim` output (console.py).

docs/simulation.md describes it.

Imports protocol/, layout, ring and numpy; never runtime/ and never a real clock inside a world. A seed fully
determines a run: `kvstage sim --seed N --trace` replays it exactly.
"""

from kvstage.sim.faults import FAULT_LEVELS, FaultProfile
from kvstage.sim.records import Violation
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
