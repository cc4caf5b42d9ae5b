"""The applications built on the library: the ``verl-prm`` command dispatcher (``cli``), the embedded demo
(``demo``), the benchmarks (``bench``), the arithmetic recipe (``arithmetic``) and the CPU-loop launcher
(``cpu_loop``). They call the library's Python API; no library module imports them (docs: layout.md)."""
