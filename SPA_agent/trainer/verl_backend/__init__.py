"""The `verl` backend of `trainer.backend.WorkerGroup`: verl's Ray/FSDP workers and server rollout
(`backend.VerlBackend`), our config translated for them (`config`), the batch layouts (`layout`) and the fixes run
in every Ray worker (`patches`); `agent_loop` and `episode` run our environments under verl's own trainers."""
