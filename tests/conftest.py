"""One Hypothesis profile for the whole suite: no deadline and no timing health checks (the suite
runs on shared 2-core machines, where input generation can be slow through no fault of the code
under test), and a fixed example count unless a test sets its own."""

from hypothesis import HealthCheck, settings

settings.register_profile("vamp", max_examples=100, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("vamp")
