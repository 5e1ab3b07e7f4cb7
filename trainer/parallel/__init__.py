"""Plan execution: layout (who does what), TP collectives, the 1F1B pipeline, gradient sync,
the per-piece optimizer. Imported by the worker; nothing here reads a job manifest."""
