"""Runtime: executors (the model forwards behind one interface) and, on top, the scheduler."""
