"""The rollout server fleet (docs/rollout.md, "Server mode"): each engine's launch spec (``hf_launch`` for the
HF-engine servers of ``hf_server``, ``vllm_server``'s settings), started by one launcher as child processes
(``fleet``) or from Ray actors on their own pool (``ray_pool``), watched and replaced when they die (``pool``,
``restarts``), and the trainer's client that spreads generation over them (``client``)."""
