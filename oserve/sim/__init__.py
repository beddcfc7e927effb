"""The simulator kernel: a discrete-event cluster of simulated engines (`oserve.engine_model`) that
policies decide for and route through, shown only what a gateway knows (`kernel`)."""
