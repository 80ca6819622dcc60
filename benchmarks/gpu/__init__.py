"""The GPU campaign's tooling, apart from the benchmarks it runs: the carried wheel kit (`kit`), the driver that runs
the campaign's steps in short device calls (`campaign`), the correctness check (`check`), the mission (`mission`), the
ahead-of-time kernel compilation (`aot_check`) and the targets read from a campaign's results (`targets`).

Each script puts benchmarks/ on `sys.path` first, so it runs from any folder and imports `lib` as the benchmarks do.
"""
