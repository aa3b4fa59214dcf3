"""The FlyDSL lab: `emulator` (the kernels played on the CPU, lane by lane), `artifacts` (what a
compiled kernel's ISA shows: K-loop shape, memory ordering, occupancy), `isa_model` (a speed model
read from the ISA) and `sweep` (the kernel set CI compiles)."""
