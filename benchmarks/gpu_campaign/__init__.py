"""The GPU campaign: the paper's tables on one lent GPU in four device commands.

    python -m benchmarks.gpu_campaign --phase e2e06|big8b|e2e4b|check --out $OUT [--device cpu]

Each phase is one device command under its own deadline (530 s by default) and writes three
files; `--device cpu` rehearses the same steps on tiny fixtures in seconds. The phases, their
arms and sizes: plan.py; the deadline: budget.py; the steps: steps.py (e2e.py, forward.py,
checks.py); the files: report.py; the carried wheels: wheels.txt and prelude.py.
docs/performance/gpu.md, "The campaign", has the device-tool commands.
"""
