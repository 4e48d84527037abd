"""Several front-end processes in front of one engine process (``--api-server-count N``, N > 1).

The main process is the engine: it loads the model, runs the real ``Scheduler`` and owns the
process tree (engine.py). It binds the API port once per front end (SO_REUSEPORT, so the kernel
spreads new connections over the front ends) and starts N front ends (frontend.py), each the
ordinary app (``server.app.create_app``) on a runner snapshot (view.py) and a ``RemoteScheduler``
(remote.py) that hands token ids to the engine over a socket pair and awaits the outputs
(wire.py: length-prefixed pickles, the frames of one loop iteration in one write). Data flows one way:
front end -> engine -> scheduler -> model. /metrics on any front end is the sum over every
process (metrics_merge.py). With N = 1 none of this is imported: the single-process path as before.
"""
