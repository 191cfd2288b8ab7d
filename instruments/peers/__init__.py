"""Peers: other inference engines holding the loaded model's weights, timed beside our modes.

Their table (``PeerSpec``, ``PEERS``, ``available``) is ``instruments.lineup.peers``; this package
holds the adapters, one module each, built in the measuring process by
``instruments.lineup.make_decoder`` from ``PeerSpec.factory``.

An adapter looks like an ``engine.decoders.Decoder``: ``prefill(ids)`` and ``step(token)``
return logits (B, vocab) as an fp32 torch tensor on the CPU; ``seek(ids, t)`` holds exactly
``ids[:, :t]`` (untimed set-up: crop where the engine can, prefill again where it cannot);
``length``, ``batch_size``, ``cache_kind`` (never None: every peer is a cached path),
``logits = "last"``, ``appends = False``, ``attended_keys(t)``, ``compile_s`` (the conversion or
export, reported apart and never inside a step), ``extra_bytes`` (bytes of the weights the
engine holds) and ``version`` (the package's). A package that is missing, or an export that
fails, raises ``instruments.lineup.PeerUnavailable`` with the reason: callers list the peer as
unavailable. An adapter whose engine runs native code it cannot trust on this CPU (llama.cpp,
compiled here) first tries its file in a throwaway process (``native.probe``): a crash there is
``PeerUnavailable("crashed (signal 11, SIGSEGV) in a probe of ...; <what to do>")``, never the
end of the measuring process.
"""
