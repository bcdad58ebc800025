"""One scheduler step: the persistent batch, the planned calls and their inputs, the compiled model, the
token hand-off between steps, the outputs on the host, and the steps in flight under async scheduling."""
