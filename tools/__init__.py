"""Developer tools: scripts (bench, bootstrap, demo, soak, test), cowfs_bench
(the package behind tools/bench) and provider_engines.py, the container and
VM engines that the tests' fixtures and tools/bench both use."""
