"""The sm90 d=64 forward's two-CTAs-per-SM tile (JAX_FLASH_SM90_TWO_PER_SM=1, kernel_traits.h RowTile::kTwoPerSm)
under compute-sanitizer: a few small cases through JAX on the persistent grid capped at 2 CTAs (set by the caller,
JAX_FLASH_SM90_PERSISTENT_CTAS=2), so that each CTA loops over several tiles and two share an SM.
Run:  JAX_FLASH_SM90_TWO_PER_SM=1 JAX_FLASH_SM90_PERSISTENT_CTAS=2 compute-sanitizer --tool racecheck \
          --target-processes application-only python3 csrc/cuda/tests/two_per_sm_sanitize.py"""
import jax.numpy as jnp
import numpy as np

from sanitizer_case import run_case

run_case("causal, GQA", 1, 300, 300, 2, 1, 64, jnp.bfloat16, causal=True)
run_case("plain, odd lengths", 1, 200, 333, 2, 2, 64, jnp.bfloat16)
segments = np.repeat(np.arange(3, dtype=np.int32), [90, 60, 107])[None]
run_case("segments", 1, 257, 257, 2, 2, 64, jnp.bfloat16, q_segment_ids=segments, kv_segment_ids=segments)
