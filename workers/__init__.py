"""The services on the bus (gateway/router, forecaster stage, scheduler, switch planner, engines).

Installed as `oserve.workers`. Its contents arrive with the live-pipeline work.
"""
