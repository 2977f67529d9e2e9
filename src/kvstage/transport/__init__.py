"""Transports: the ZeroMQ control plane (`control`), the bootstrap service (`bootstrap`) and the data backends
(`data`). Imports point down only: transport/ uses protocol/, layout and errors, never runtime/.
"""
