"""Adapters that plug expstore into the trainers RL teams already run (docs/integrations.md).

* ``transfer_queue``: a TransferQueue storage backend (``storage_backend: Expstore``), so
  that verl's (and any TransferQueue user's) data flow stores through expstore, durably;
* ``verl``: ``DataProto`` <-> Arrow, to sample GRPO groups from a trajectory table into a
  verl trainer and write its advantages back.

Each module imports its framework (torch, tensordict, transfer_queue, verl) itself: the
client never needs them, and importing ``expstore_client`` does not import these.
"""
