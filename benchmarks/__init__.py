"""Developer micro-benchmarks: the trie builder, the forward, the prefix cache, the row gathers,
the packed linears, and the one-shot GPU check (see benchmarks/README.md).

Unlike loadtest/ (the user's HTTP load tester), these import models/ and kernels/ directly and
time them in process. Invariant: they print figures and assert nothing; tests cover their
plumbing, never a time.
"""
