"""The rollout server fleet (docs/rollout.md, "Server mode"): HF-engine servers speaking SGLang's routes
(``hf_server``), started as subprocesses (``pool``) or as Ray actors on their own pool (``ray_pool``), replaced
when they die (``restarts``), and the trainer's client that spreads generation over them (``client``)."""
