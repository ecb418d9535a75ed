"""What a pod admits of the `kv_transfer_params` it is sent, decided by the front end as
it parses them, before anything reaches the engine core.

- A pod without a connector config admits none (it runs without KV transfer).
- A pod configured for transfers without a key (and not `--kv-transfer-insecure`) admits
  none: a 400 that says how to give it the key.
- A decode pod admits no `do_remote_decode`: it never holds blocks for another pod.
- `do_remote_prefill` params must carry this service's signature and be unexpired (a pod
  with a key). Under failure policy `fail` others are a 400; under `recompute` they are
  dropped and the prompt is computed here. Either way nothing they name is contacted, and
  the refusal is counted by reason (`kvferry:kv_transfer_failures_total`; a recompute is
  also a `kvferry:kv_transfer_fallbacks_total`), as the engine core's connector counts
  the refusals it makes itself.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvferry.kvtransfer.auth import KEY_ENV, MIN_KEY_BYTES, check_params
from kvferry.kvtransfer.config import KVTransferConfig
from kvferry.kvtransfer.metrics import KVTransferMetrics
from kvferry.kvtransfer.params import KVTransferParams

logger = logging.getLogger(__name__)

NO_KEY_MESSAGE = (
    "kv_transfer_params: this pod has no KV transfer key, so it takes part in no KV transfer. "
    "Give every pod of the service the same key (at least {min_bytes} bytes) with "
    "--kv-transfer-key-file FILE or ${env} (the operator mounts one from a Secret, kvferry up "
    "generates one), or run with --kv-transfer-insecure on a trusted network"
)


class TransferAdmission:
    """Admits or refuses one pod's incoming transfer params; counts what it refuses."""

    def __init__(self, config: KVTransferConfig | None,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self._clock = clock
        # Refusals by reason, exported beside the engine core's own transfer counters.
        self.metrics = KVTransferMetrics()
        self._lock = threading.Lock()
        self._num_fallbacks = 0

    @property
    def num_fallbacks(self) -> int:
        """Requests whose params were refused and that were computed here instead."""
        with self._lock:
            return self._num_fallbacks

    def admit(self, params: KVTransferParams) -> KVTransferParams | None:
        """The params to act on, or None (refused: compute the prompt here; a hold for a
        remote decode that came with them still stands).

        Raises ValueError, with the client's 400 message, for params this pod refuses.
        """
        config = self._require_transfers()
        if params.do_remote_decode and config.role == "decode":
            raise ValueError("kv_transfer_params.do_remote_decode: this is a decode pod, which "
                             "holds no blocks for another pod; send the prefill hop to a prefill "
                             "pod (--role prefill) or a colocated one (--role both)")
        if not params.do_remote_prefill or config.transfer_key is None:
            return params
        refusal = check_params(params, config.transfer_key, self._clock())
        if refusal is None:
            return params
        self.metrics.count_failure(refusal.reason)
        if config.failure_policy == "fail":
            raise ValueError(f"{refusal.message} (refused before contacting "
                             f"{params.remote_host}:{params.remote_port})")
        logger.warning("kv_transfer_params refused (%s): %s; computing the prompt here, "
                       "without contacting %s:%s", refusal.reason.value, refusal.message,
                       params.remote_host, params.remote_port)
        with self._lock:
            self._num_fallbacks += 1
        return params.without_pull()

    def _require_transfers(self) -> KVTransferConfig:
        if self.config is None:
            raise ValueError("kv_transfer_params: this server runs without KV transfer (start "
                             "it with --role prefill, decode, or --kv-transfer)")
        if not self.config.may_transfer:
            raise ValueError(NO_KEY_MESSAGE.format(min_bytes=MIN_KEY_BYTES, env=KEY_ENV))
        return self.config
