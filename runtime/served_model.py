"""What one prefill or decode instance serves, as its servicer checks requests against it."""

from __future__ import annotations

from dataclasses import dataclass

from engine.checkpoint import ModelFiles, model_fingerprint
from engine.loader import load_config


@dataclass(frozen=True)
class ServedModel:
    """The model behind one instance's servicer, and the instance's name for it.

    Built once in each service's main() from the checkpoint (`engine.loader.load_config`,
    `engine.checkpoint.model_fingerprint`).
    """

    instance_id: str
    """The instance's name in spans, logs, stats and the prefix index."""
    vocab_size: int
    """Token ids must be in [0, vocab_size)."""
    max_context: int
    """Tokens one sequence may hold, prompt and answer together."""
    fingerprint: str
    """Identifies the checkpoint: a gateway refuses instances whose fingerprints differ."""
    eos_token_ids: frozenset[int] = frozenset()
    """The ids that end an answer (decode stops on them unless the request ignores EOS)."""

    @classmethod
    def of(cls, files: ModelFiles, instance_id: str) -> ServedModel:
        """The checkpoint `files` as served by `instance_id`. Raises ValueError when its config is
        missing a field or invalid (`engine.loader.load_config`)."""
        config = load_config(files)
        return cls(
            instance_id,
            config.vocab_size,
            config.max_position_embeddings,
            model_fingerprint(files),
            frozenset(config.eos_token_ids),
        )
