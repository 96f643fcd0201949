"""Commands built on the build and runtime sides: verify, eval, selftest, serve."""
