"""Fault handling for the whole library: failure propagation across ranks, collective-order verification,
preemption, resume, fault injection for tests. Each concern is one module here; see docs/architecture.md."""
