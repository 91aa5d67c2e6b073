"""The launch side of a job: the ``elastictrain`` command, its run configuration, the node agent
and what it sets up for its workers (their forkserver, boot and control channel), local nodes,
the run's state in etcd and its status, and failure reports.

Nothing here is imported by a training worker (:mod:`elastictrain.train`), and ``elastictrain
--help`` imports no torch: this package's ``__init__`` imports nothing.
"""
