"""The exercises' reference solutions, one module per exercise (catalog.EXERCISES names them). Each is also
the source of its stub: `exercises start N` writes it with every function's body and every ANSWER blanked
(catalog.stub_text), so the stub and the solution cannot disagree about names, signatures or the task."""
