"""specmesh drafter service: serves draft trees for many sessions over gRPC (specmesh.v1.Drafter),
drafting each session's next tree ahead while the verifier checks the current one.

`python -m drafter_service --port P --drafter ngram|model:PATH|oracle:ALPHA`. The drafting itself
lives in the core (`specmesh.drafters`, `specmesh.drafters.predraft`); this package is transport.
"""
