"""The driver side's failure model: how the driver learns that a call cannot finish.

* ``state``: one group's failure state (``FailureState``) and ``CallWatch``.
* ``health``: what the scheduler, the nannies and the heartbeats said of the driver's
  workers (lost, suspected, paused), owned by the client's event loop (``WorkerHealth``).
* ``losses``: what a removed worker means, in words; futures failed with typed errors.
* ``calls``: the calls the driver still has to account for (stuck, abandoned, in flight).
* ``heartbeat``: TCP keepalive to every worker of the driver's groups.
* ``waiting``: waits on task-path futures, and the deadline report of any wait.
* ``root_cause``: which error a failed call raises when a worker of its group died with it
  (the dead rank's ``WorkerLostError``, not a survivor's peer error).
* ``forensics``: what the ranks are doing (``wg.status()``, ``CallTimeoutError``).
"""
