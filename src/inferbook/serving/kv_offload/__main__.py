"""`python -m inferbook.serving.kv_offload peer ...`: run a KV peer (see `peer.main`)."""
from .peer import main

main()
