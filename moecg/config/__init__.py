"""moecg.config: typed config groups and the readers they share (below moecg.plan and moecg.workload)."""
