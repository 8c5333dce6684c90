"""vLLM-format KV-cache events: what every replica publishes and every router reads.

    hashing.py     shepherd's block hash (16-token blocks, chained SHA-256, low 64 bits)
    events.py      BlockStored / BlockRemoved / AllBlocksCleared / EventBatch (vLLM 0.32's layout)
    codec.py       msgpack on the wire: tagged maps out, tagged maps and positional arrays in
    tracker.py     the radix cache's records -> events (the engine's side, on the publisher thread)
    index.py       events -> which replica holds which blocks (the router's side)
    publisher.py   ZMQ PUB + ROUTER replay in the engine core (a thread, off the token path)
    subscriber.py  ZMQ SUB + replay per replica, sequence tracking, into an index

docs/ROUTING.md ("Fleets") has the flags and the protocol.
"""
