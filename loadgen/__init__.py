"""Load generator and benchmark harness for detserve (see loadgen/README.md)."""
