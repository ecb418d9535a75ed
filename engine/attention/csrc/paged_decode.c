/*
 * Paged decode attention on CPU, float32: one query token per sequence, keys and values
 * read in place from the paged cache through the block table (no gather, no padding).
 *
 * Layout (the engine's cache, seen through one layer's strided views):
 *   key_cache / value_cache: block b starts at `b * block_stride` elements and holds
 *   (block_size, num_kv_heads, head_size) contiguous values.
 *   query / out: (num_tokens, num_heads, head_size) contiguous.
 *   block_tables: (num_reqs, block_table_stride) int32, row `req_rows[i]` for sequence i.
 *
 * Work is split over sequences. Each computes the scores of every query head against
 * every key (one pass over the keys, block by block; query head h reads kv head
 * h / (num_heads / num_kv_heads)), a softmax per head, then the weighted sum of values
 * (one pass over the values).
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float dot(const float *a, const float *b, int n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int d = 0; d < n; ++d) acc += a[d] * b[d];
    return acc;
}

static inline void axpy(float *y, float alpha, const float *x, int n) {
#pragma omp simd
    for (int d = 0; d < n; ++d) y[d] += alpha * x[d];
}

/* Returns 0 on success, 1 if scratch memory could not be allocated. */
int kvferry_paged_decode_f32(
    const float *query, const float *key_cache, const float *value_cache,
    int64_t block_stride, const int32_t *block_tables, int64_t block_table_stride,
    const int64_t *req_rows, const int64_t *token_rows, const int32_t *seq_lens,
    int64_t num_seqs, int num_heads, int num_kv_heads, int head_size, int block_size,
    int max_seq_len, float scale, float *out) {
    const int group = num_heads / num_kv_heads;
    const int64_t token_stride = (int64_t)num_heads * head_size;
    const int64_t slot_stride = (int64_t)num_kv_heads * head_size;
    int failed = 0;

#pragma omp parallel
    {
        /* Per thread: scores (num_heads x max_seq_len) and the output accumulator. */
        float *scores = malloc(sizeof(float) * (size_t)num_heads * (size_t)max_seq_len);
        float *acc = malloc(sizeof(float) * (size_t)num_heads * (size_t)head_size);
        if (scores == NULL || acc == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        /* One sequence per task: its blocks are read front to back, all kv heads at once. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_seqs; ++i) {
            if (scores == NULL || acc == NULL) continue;
            const int len = seq_lens[i];
            const int32_t *table = block_tables + req_rows[i] * block_table_stride;
            const float *q = query + token_rows[i] * token_stride;
            float *o = out + token_rows[i] * token_stride;

            for (int t0 = 0, b = 0; t0 < len; t0 += block_size, ++b) {
                const int n = len - t0 < block_size ? len - t0 : block_size;
                const float *kb = key_cache + (int64_t)table[b] * block_stride;
                if (t0 + block_size < len)
                    __builtin_prefetch(key_cache + (int64_t)table[b + 1] * block_stride);
                for (int j = 0; j < n; ++j) {
                    const float *k = kb + (int64_t)j * slot_stride;
                    for (int h = 0; h < num_heads; ++h)
                        scores[(int64_t)h * max_seq_len + t0 + j] =
                            dot(q + (int64_t)h * head_size, k + (int64_t)(h / group) * head_size,
                                head_size) * scale;
                }
            }
            for (int h = 0; h < num_heads; ++h) {
                float *s = scores + (int64_t)h * max_seq_len;
                float max_score = s[0];
                for (int t = 1; t < len; ++t) max_score = s[t] > max_score ? s[t] : max_score;
                float total = 0.0f;
#pragma omp simd reduction(+ : total)
                for (int t = 0; t < len; ++t) {
                    s[t] = expf(s[t] - max_score);
                    total += s[t];
                }
                const float inv_total = 1.0f / total;
#pragma omp simd
                for (int t = 0; t < len; ++t) s[t] *= inv_total;
            }
            memset(acc, 0, sizeof(float) * (size_t)num_heads * (size_t)head_size);
            for (int t0 = 0, b = 0; t0 < len; t0 += block_size, ++b) {
                const int n = len - t0 < block_size ? len - t0 : block_size;
                const float *vb = value_cache + (int64_t)table[b] * block_stride;
                if (t0 + block_size < len)
                    __builtin_prefetch(value_cache + (int64_t)table[b + 1] * block_stride);
                for (int j = 0; j < n; ++j) {
                    const float *v = vb + (int64_t)j * slot_stride;
                    for (int h = 0; h < num_heads; ++h)
                        axpy(acc + (int64_t)h * head_size, scores[(int64_t)h * max_seq_len + t0 + j],
                             v + (int64_t)(h / group) * head_size, head_size);
                }
            }
            memcpy(o, acc, sizeof(float) * (size_t)num_heads * (size_t)head_size);
        }
        free(scores);
        free(acc);
    }
    return failed;
}
