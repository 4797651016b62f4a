"""What the tests, the benchmarks and the soak script share, kept out of the production package:
`braid serve` as a child process (process.py), and fault injection through the engine's ports
(faults.py, with serve.py: `braid serve` with the faults BRAID_INJECT_FAULT asks for)."""
