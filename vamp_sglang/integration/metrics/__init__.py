"""`vamp:*` Prometheus series and `GET /vamp/stats`."""
