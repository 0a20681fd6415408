//! Simulated model server (placeholder; built in its own change).
