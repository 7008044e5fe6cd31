"""Developer tools: scripts (bench, bootstrap, demo, soak, test), cowfs_bench
(the package behind tools/bench) and provider_daemons.py, the container and
VM daemons that the tests' fixtures and tools/bench both use."""
