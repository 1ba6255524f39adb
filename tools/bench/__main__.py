"""``python -m tools.bench``: the benchmark driver (``tools.bench.run``)."""

from tools.bench.run import main

main()
