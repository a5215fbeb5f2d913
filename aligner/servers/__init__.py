"""PyTriton microservices and their client.

protocol.py       every endpoint's tensors and the request checks (shared by servers and client)
triton.py         the PyTriton adapter: ports, readiness file, SIGTERM, workspace, libpython fix
engine.py         collective execution: rank 0 broadcasts requests, all ranks run the model
common.py         job start-up, request batching, served-reward post-processing
reward_server.py  `aligner serve reward`
critic_server.py  `aligner serve critic` (critic_infer / critic_train / critic_save, optional RM)
verifier_server.py `aligner serve verifier` (rule-based rewards)
config.py         loading and checking the serve configs
client.py         what the actor uses: futures, typed per-sample results, retries, readiness
process.py        start / await / stop a server process (tests, benchmarks, local launchers)
"""
