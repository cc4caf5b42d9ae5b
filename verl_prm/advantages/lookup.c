/* The per-token lookup of verl_prm.advantages.process_advantage on the CPU, with the tensor contract's flags.

   For the rows i in [row0, row1):
     out[i, t] = table[i, clamp(ids[i, t] + 1, 0, C - 1)] * (float) mask[i, t]
     bad[i]    = 1 if an id of row i lies outside [-1, num_steps[i] - 1]; with small checks also if num_steps[i]
                 lies outside [0, S], a real step's value (h < num_steps[i]) or the prompt's value is not in [0, 1]
                 (NaN included), or the outcome is not finite (verl_prm.advantages.bad_input_rows)

   Why C: the lookup reads each token's table entry through its step id, and torch.compile's CPU code makes that a
   scalar load per token (inductor has no vector gather), about twice the time of the memory traffic. A row's table
   has S + 1 entries, so with AVX-512 up to 64 of them sit in four registers and a permute looks up 16 tokens in
   one instruction; longer tables use the hardware gather. Without AVX-512 the plain loop is left to the compiler
   (it measured slower than torch.compile's kernel, which verl_prm.advantages.fused then uses).
   Built by verl_prm.advantages.native with the machine's C compiler (-O3 -march=native), called through ctypes
   (which releases the GIL, so row ranges run on several threads).

   The ids are clamped exactly as verl_prm.advantages.lookup clamps them, so an out-of-range id (possible with the
   checks off) reads its own row; int64 ids are checked as int64 and saturated, never wrapped, before the clamp. */

#include <math.h>
#include <stdint.h>

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#include <immintrin.h>
#define LOOKUP_AVX512 1
#endif

/* clamp(id, -1, columns - 2) + 1, clamped before the + 1 so that no id can overflow */
static inline int64_t clamp_index(int64_t id, int64_t columns) {
    return (id < -1 ? -1 : (id > columns - 2 ? columns - 2 : id)) + 1;
}

static int small_checks_fail(int64_t i, int64_t steps, const float* step_values, const float* prompt_values,
                             const int64_t* num_steps, const float* outcome) {
    int64_t n = num_steps[i];
    if (n < 0 || n > steps) return 1;
    const float* values = step_values + i * steps;
    for (int64_t h = 0; h < n; h++) {
        if (!(values[h] >= 0.0f && values[h] <= 1.0f)) return 1;
    }
    if (!(prompt_values[i] >= 0.0f && prompt_values[i] <= 1.0f)) return 1;
    return !isfinite(outcome[i]);
}

#ifdef LOOKUP_AVX512
/* 16 ids as int32 indices into the table (saturated, then clamped) and the running min / max of the raw ids. */
static inline __m512i load_ids_i64(const int64_t* ids, __m512i* low, __m512i* high) {
    __m512i a = _mm512_loadu_si512((const void*)ids), b = _mm512_loadu_si512((const void*)(ids + 8));
    *low = _mm512_min_epi64(*low, _mm512_min_epi64(a, b));
    *high = _mm512_max_epi64(*high, _mm512_max_epi64(a, b));
    __m256i a32 = _mm512_cvtsepi64_epi32(a), b32 = _mm512_cvtsepi64_epi32(b);
    return _mm512_inserti64x4(_mm512_castsi256_si512(a32), b32, 1);
}

static inline __m512i load_ids_i32(const int32_t* ids, __m512i* low, __m512i* high) {
    __m512i a = _mm512_loadu_si512((const void*)ids);
    *low = _mm512_min_epi32(*low, a);
    *high = _mm512_max_epi32(*high, a);
    return a;
}

static inline __m512 load_mask_f32(const float* m) { return _mm512_loadu_ps(m); }
static inline __m512 load_mask_i64(const int64_t* m) {
    __m256 a = _mm512_cvtepi64_ps(_mm512_loadu_si512((const void*)m));
    __m256 b = _mm512_cvtepi64_ps(_mm512_loadu_si512((const void*)(m + 8)));
    return _mm512_insertf32x8(_mm512_castps256_ps512(a), b, 1);
}
static inline __m512 load_mask_i32(const int32_t* m) {
    return _mm512_cvtepi32_ps(_mm512_loadu_si512((const void*)m));
}
static inline __m512 load_mask_u8(const uint8_t* m) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)m)));
}

/* Up to 64 table entries in four registers (zeros past the row's end: the clamp never reads them). */
static inline __m512 table_part(const float* row, int64_t columns, int64_t start) {
    int64_t n = columns - start;
    if (n <= 0) return _mm512_setzero_ps();
    __mmask16 keep = n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1u);
    return _mm512_maskz_loadu_ps(keep, row + start);
}

static inline __m512 table_lookup(__m512i index, const float* row, int64_t columns, __m512 t0, __m512 t1, __m512 t2,
                                  __m512 t3) {
    if (columns <= 16) return _mm512_permutexvar_ps(index, t0);
    if (columns <= 32) return _mm512_permutex2var_ps(t0, index, t1);
    if (columns <= 64) {
        __m512 low = _mm512_permutex2var_ps(t0, index, t1), high = _mm512_permutex2var_ps(t2, index, t3);
        return _mm512_mask_blend_ps(_mm512_test_epi32_mask(index, _mm512_set1_epi32(32)), low, high);
    }
    return _mm512_i32gather_ps(index, row, 4);
}
#endif

/* LOOKUP_ROWS(name, id type, mask type, id loader, mask loader, vector min/max reducers, lowest/highest id init) */
#ifdef LOOKUP_AVX512
#define VECTOR_PART(ID_T, LOAD_IDS, LOAD_MASK, REDUCE_MIN, REDUCE_MAX, SET1)                                        \
    {                                                                                                                \
        __m512 t0 = table_part(row, columns, 0), t1 = table_part(row, columns, 16);                                  \
        __m512 t2 = table_part(row, columns, 32), t3 = table_part(row, columns, 48);                                 \
        __m512i low = SET1(0), high = SET1(-1);                                                                      \
        const __m512i minus_one = _mm512_set1_epi32(-1), one = _mm512_set1_epi32(1);                                 \
        const __m512i last_step = _mm512_set1_epi32((int32_t)(columns - 2));                                         \
        for (; t < length && ((uintptr_t)(out_row + t) & 63u) != 0; t++) { /* to a 64-byte boundary of out */       \
            int64_t id = (int64_t)ids_row[t];                                                                        \
            lowest = id < lowest ? id : lowest;                                                                      \
            highest = id > highest ? id : highest;                                                                   \
            out_row[t] = row[clamp_index(id, columns)] * (float)mask_row[t];                                         \
        }                                                                                                            \
        for (; t + 16 <= length; t += 16) {                                                                          \
            __m512i id = LOAD_IDS(ids_row + t, &low, &high);                                                         \
            __m512i index = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(id, minus_one), last_step), one);   \
            __m512 value = table_lookup(index, row, columns, t0, t1, t2, t3);                                        \
            _mm512_stream_ps(out_row + t, _mm512_mul_ps(value, LOAD_MASK(mask_row + t)));                          \
        }                                                                                                            \
        int64_t vector_lowest = REDUCE_MIN(low), vector_highest = REDUCE_MAX(high);                                  \
        lowest = vector_lowest < lowest ? vector_lowest : lowest;                                                    \
        highest = vector_highest > highest ? vector_highest : highest;                                               \
    }
/* the streaming stores (which skip reading the output's cache lines before writing them: a third less memory
   traffic) are weakly ordered: a fence before the caller reads the output */
#define FENCE _mm_sfence();
#else
#define VECTOR_PART(ID_T, LOAD_IDS, LOAD_MASK, REDUCE_MIN, REDUCE_MAX, SET1)
#define FENCE
#endif

#define LOOKUP_ROWS(NAME, ID_T, MASK_T, LOAD_IDS, LOAD_MASK, REDUCE_MIN, REDUCE_MAX, SET1)                          \
    void NAME(const float* table, const ID_T* ids, const MASK_T* mask, const int64_t* num_steps, float* out,          \
              uint8_t* bad, int64_t row0, int64_t row1, int64_t length, int64_t columns, const float* step_values,    \
              const float* prompt_values, const float* outcome) {                                                    \
        int64_t steps = columns - 1;                                                                                 \
        for (int64_t i = row0; i < row1; i++) {                                                                      \
            const float* row = table + i * columns;                                                                  \
            const ID_T* ids_row = ids + i * length;                                                                  \
            const MASK_T* mask_row = mask + i * length;                                                              \
            float* out_row = out + i * length;                                                                       \
            int64_t t = 0, lowest = 0, highest = -1;                                                                 \
            VECTOR_PART(ID_T, LOAD_IDS, LOAD_MASK, REDUCE_MIN, REDUCE_MAX, SET1)                                     \
            for (; t < length; t++) {                                                                                \
                int64_t id = (int64_t)ids_row[t];                                                                    \
                lowest = id < lowest ? id : lowest;                                                                  \
                highest = id > highest ? id : highest;                                                               \
                out_row[t] = row[clamp_index(id, columns)] * (float)mask_row[t];                                     \
            }                                                                                                        \
            int flag = lowest < -1 || highest >= num_steps[i];                                                       \
            if (step_values && !flag)                                                                                \
                flag = small_checks_fail(i, steps, step_values, prompt_values, num_steps, outcome);                  \
            bad[i] = (uint8_t)flag;                                                                                  \
        }                                                                                                            \
        FENCE                                                                                                        \
    }

#ifdef LOOKUP_AVX512
#define SET1_64(x) _mm512_set1_epi64(x)
#define SET1_32(x) _mm512_set1_epi32(x)
LOOKUP_ROWS(lookup_i64_f32, int64_t, float, load_ids_i64, load_mask_f32, _mm512_reduce_min_epi64,
            _mm512_reduce_max_epi64, SET1_64)
LOOKUP_ROWS(lookup_i64_i64, int64_t, int64_t, load_ids_i64, load_mask_i64, _mm512_reduce_min_epi64,
            _mm512_reduce_max_epi64, SET1_64)
LOOKUP_ROWS(lookup_i64_i32, int64_t, int32_t, load_ids_i64, load_mask_i32, _mm512_reduce_min_epi64,
            _mm512_reduce_max_epi64, SET1_64)
LOOKUP_ROWS(lookup_i64_u8, int64_t, uint8_t, load_ids_i64, load_mask_u8, _mm512_reduce_min_epi64,
            _mm512_reduce_max_epi64, SET1_64)
LOOKUP_ROWS(lookup_i32_f32, int32_t, float, load_ids_i32, load_mask_f32, _mm512_reduce_min_epi32,
            _mm512_reduce_max_epi32, SET1_32)
LOOKUP_ROWS(lookup_i32_i64, int32_t, int64_t, load_ids_i32, load_mask_i64, _mm512_reduce_min_epi32,
            _mm512_reduce_max_epi32, SET1_32)
LOOKUP_ROWS(lookup_i32_i32, int32_t, int32_t, load_ids_i32, load_mask_i32, _mm512_reduce_min_epi32,
            _mm512_reduce_max_epi32, SET1_32)
LOOKUP_ROWS(lookup_i32_u8, int32_t, uint8_t, load_ids_i32, load_mask_u8, _mm512_reduce_min_epi32,
            _mm512_reduce_max_epi32, SET1_32)
#else
LOOKUP_ROWS(lookup_i64_f32, int64_t, float, , , , , )
LOOKUP_ROWS(lookup_i64_i64, int64_t, int64_t, , , , , )
LOOKUP_ROWS(lookup_i64_i32, int64_t, int32_t, , , , , )
LOOKUP_ROWS(lookup_i64_u8, int64_t, uint8_t, , , , , )
LOOKUP_ROWS(lookup_i32_f32, int32_t, float, , , , , )
LOOKUP_ROWS(lookup_i32_i64, int32_t, int64_t, , , , , )
LOOKUP_ROWS(lookup_i32_i32, int32_t, int32_t, , , , , )
LOOKUP_ROWS(lookup_i32_u8, int32_t, uint8_t, , , , , )
#endif

/* Whether this build has the AVX-512 path (reported by verl_prm.advantages.native). */
int lookup_vectorised(void) {
#ifdef LOOKUP_AVX512
    return 1;
#else
    return 0;
#endif
}
