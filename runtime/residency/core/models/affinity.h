/* affinity: the model behind prefetch `affinity` (internal to the residency core).
 *
 * Learned online from decode routing and from the prompt's chunks: for MoE layers (index i,
 * i + lead) of the same token, pair[i][e][e'] counts tokens routed to e at i and e' at
 * i + lead, count[i][e] the tokens routed to e at i whose layer i + lead was seen, for e one of
 * the token's sources at i: its first AF_SOURCES (4) distinct experts in routing order, the
 * router's strongest (on the real traces all of qwen3-30b-a3b's 6 scored no better, and a
 * plan's cost is its sources' rows). A decode layer-step is one token (its distinct
 * experts); a prompt chunk's rows are token-major,
 * n_expert_used per token (k, given at creation; 0: prompt chunks are not learned), and each
 * of its tokens counts as one decode token would, paired with the same chunk at layer
 * i + lead (observed lead layer-steps earlier, with as many rows). Most of what a prompt
 * teaches is what decode misses: an expert the prompt used and decode has not yet (of
 * gpt-oss-120b's non-cold decode misses at 20 % of its expert bytes, lead 5, 1 % had
 * q >= 0.3 from decode-only tables, 11 % with the prompt's pairs). After a decode layer-step
 * of layer i, the prediction for layer i + lead is
 *     q(e') = (1 / |S'|) * sum over e in S' of pair[i][e][e'] * (1 / count[i][e])
 * (S the step's sources, S' those with count > 0), blended with the vote of the tokens routed
 * most like this one so far (neighbours.h: (1 - NB_BLEND) q + NB_BLEND vote; the vote alone
 * when S' is empty; no plan when neither knows anything)
 * and the plan is the top_n experts by q (ties: lower id) among the keys of layer i + lead
 * that need a transfer (state absent: a resident or in-flight key is never a candidate, so
 * the plan's slots go to what a prefetch can change), with calibrated q >= min_precision:
 *     calibrated q = min(1, q * (hits + AF_PRIOR) / (predicted + AF_PRIOR))
 * the measured hits per predicted hit (the decayed tallies below: predicted is the sum of the
 * scored keys' q), shrunk toward 1 by a prior of AF_PRIOR (8) predicted hits. The raw q is
 * overconfident where its counts are small: uncalibrated, the prefetches issued with q in
 * [0.5, 0.7) were used in time 6-17 % of the time on gpt-oss-120b (2 experts per token, 64
 * decode tokens; 10-30 % of the expert bytes), 71-80 % on qwen3-30b-a3b (6 per token, 128).
 * The calibrated q is also what ranks a prefetch against victims.
 * The table is 16-bit (half the bytes a plan reads, the largest cost of planning): when a
 * count[i][e] at 65535 would grow, the row pair[i][e][*] and the count are halved first
 * (integer halves), and a routing profile's rows are shifted down until they fit; until then
 * the counts are exact.
 * A transfer of b bytes occupies the link for latency + b / link_bps: in link bytes,
 *     cost(b) = b + link_bps * latency                                  (af_transfer_cost)
 * The lead, fixed at creation, is what one expert needs to cross the link in time: with
 * link_bytes the bytes the link carries in one typical layer-step's compute (the policy's
 * layer_us) and t the largest expert's cost,
 *     lead = max(1, ceil(2 t / link_bytes))   (at most n_moe - 1)
 * Prefetches queue on the link. A decode layer-step's experts compute for
 *     step_s = hits * b / gpu_bps + misses * min(latency + b / link_bps + b / gpu_bps, b / cpu_bps)
 * on the cost model's rates ([cost]; the replay clock's step without its dense part, so it
 * never over-counts the link's time); the link carries link_bps * step_s of the queue
 * (backlog) meanwhile, and a prefetch planned now must have crossed when layer i + lead's
 * experts start, after this step's experts and lead - 1 more steps (estimated by the running
 * mean of step_s, decay AF_DECAY). So a planned key is issued only while
 *     backlog + cost(b) <= link_bps * (step_s + (lead - 1) * mean step_s)
 * and its cost joins the backlog (given back if it is not issued). When not even one
 * transfer of layer i + lead would fit, the q rows are not computed; if the link is idle then
 * (backlog 0), the nearest MoE layer up to lead further ahead (i + lead + d, d <= lead) with
 * no plan pending and room for a transfer (this step plus lead - 1 + d steps of the mean) is
 * planned from the neighbours' vote alone (the table holds layers lead apart only; a layer
 * no token votes for is passed over), and ranked against victims as plan_lead = lead + d
 * layers ahead; otherwise nothing is planned (nor scored). Such a plan is replaced, unscored,
 * when the layer's own plan comes (lead layer-steps before it) before its visit: keeping it
 * instead and skipping the layer's own plan scored 1.802x against 1.797x Belady. A key at
 * calibrated q 0 never enters a plan (min_precision 0 would let it). Most layer-steps at 20-30 % of the expert bytes are all hits, too short for a
 * transfer to reach i + lead: qwen3-30b-a3b 20 / 30 % 1.93 / 2.20x -> 1.91 / 2.18x, the
 * matrix 1.807x -> 1.797x Belady (1.792x -> 1.782x forced), no cell higher (planning further
 * while the link was busy: 1.799x, gpt-oss at 10 and 20 % higher).
 * Precision is measured on every plan, issued or not (but a replaced one, above), at its
 * target layer's visit (decayed tallies, by 1 - 1 / n_moe per plan, about one token's plans: hits, and the raw q summed as
 * predicted): it calibrates q above, which is the only gate (a gate that stopped every plan
 * while the measured precision was below min_precision, planning one layer-step in 8 to keep
 * measuring, stopped the calibrated candidates that do pay: without it 1.868x -> 1.855x
 * Belady on the real traces, no cell worse). An empty plan is scored too: it decays the
 * tallies, so once nothing passes for a while the prior takes over and the calibration
 * drifts back toward 1 (what re-measures a predictor that went bad, or recovered). The prior
 * and the token-long memory replaced a hard start over at 1 once the tallies (then decayed
 * by 0.9 per plan) fell below 8 predictions: on routing with no structure (bench_manager's
 * stream) that reset let through bursts of wasted prefetches (18,000 issued over 1000 tokens
 * with the neighbour vote, 4,200 now), and on the real traces it scored 1.794x forced Belady
 * against 1.792x now.
 * Operations are in the order of the Python reference (runtime/residency/reference/affinity.py).
 */
#ifndef AFFINITY_H
#define AFFINITY_H
#include <stdint.h>

#include "neighbours.h"

typedef struct {
    int32_t n_layer, n_expert, n_moe, lead;
    int32_t plan_lead;            /* how far ahead the latest plan is: lead, or up to 2 lead */
    int32_t k;                    /* experts per token (n_expert_used); 0 unknown */
    int32_t *moe_index;           /* (n_layer,) position among the MoE layers, -1 dense */
    int32_t *moe_layers;          /* (n_moe,) */
    uint16_t *pair;               /* ((n_moe - lead) * E * E,) 16-bit: each <= its count */
    int32_t *count;               /* ((n_moe - lead) * E,) <= AF_COUNT_MAX (65535) */
    int64_t step;                 /* layer-steps observed (every phase) */
    int32_t *src;                 /* (n_moe, E) each MoE layer's latest decode routing */
    int32_t *n_src;               /* (n_moe,) distinct experts, in routing order */
    int64_t *src_step;            /* (n_moe,) the step it was observed at, -1 none */
    int32_t *pred;                /* (n_moe, E) the pending plan for each target layer */
    int32_t *n_pred;              /* (n_moe,) -1: none pending */
    uint8_t *mark;                /* (E,) scratch, 0 between calls */
    int32_t *distinct;            /* (E,) scratch: a layer-step's distinct experts */
    double *q, *top_q;            /* (E,) scratch */
    int32_t **chunk;              /* (n_moe,) each MoE layer's latest prompt chunk's routing,
                                     (n_chunk / k, k) token-major */
    int64_t *chunk_cap;           /* (n_moe,) its capacity, elements */
    int32_t *n_chunk;             /* (n_moe,) its elements */
    int64_t *chunk_step;          /* (n_moe,) the step it was observed at, -1 none */
    double hits;                  /* decayed tallies: hits of the scored plans, and */
    double predicted;             /* the sum of their predictions' raw q */
    double tally_keep;            /* their decay per plan: 1 - 1 / n_moe */
    double *pred_sum;             /* (n_moe,) the pending plan's raw q, summed */
    double backlog;               /* link bytes queued for prefetch, not yet carried */
    double last_step_s, step_ema; /* the latest step's expert compute, and its running mean
                                     (AF_DECAY; -1: none yet), seconds */
    double top_n, min_precision, link_bytes;
    double link_bps, latency_s, gpu_bps, cpu_bps;  /* the [cost] rates: bytes/s, s */
    double per_transfer;          /* link_bps * latency_s: a transfer's fixed cost, bytes */
    nb_model *nb;                 /* the token-neighbour vote (neighbours.h); NULL: k unknown */
    double *nb_v;                 /* (E,) scratch: its vote, 0 between plans */
    int32_t *nb_voted;            /* (NB_K * k,) scratch: the experts voted for */
} af_model;

af_model *af_create(int32_t n_layer, int32_t n_expert, const int32_t *moe_layers, int32_t n_moe,
                    double top_n, double min_precision, double link_bytes,
                    double max_expert_bytes, const double *rates, int32_t n_expert_used);
/* rates (4,): link bytes/s, link latency s, GPU and CPU expert-compute bytes/s;
 * n_expert_used: experts per token (a prompt chunk's rows are token-major), 0 unknown */
void af_free(af_model *m);
/* a layer-step (every phase): scores the latest plan, learns pairs (decode, prompt chunks);
 * 0, or -1 out of memory */
int af_observe(af_model *m, int32_t layer, const int32_t *el, int32_t n, int32_t phase);
/* the plan after a decode layer-step of `layer` that had n_hits hits and n_misses misses:
 * flat keys into out (capacity n_expert), their calibrated q into out_q; returns how many;
 * keys with state[f] == absent_state need a transfer (the only candidates) */
int32_t af_plan(af_model *m, int32_t layer, int32_t n_hits, int32_t n_misses,
                const uint8_t *state, uint8_t absent_state, const int64_t *bytes_flat,
                int32_t *out, double *out_q);
/* a transfer's link cost in bytes: bytes + link_bps * latency */
double af_transfer_cost(const af_model *m, int64_t bytes);
/* add a routing profile's table: pair ((n_moe - 1) * E * E,), count ((n_moe - 1) * E,), the
 * pairs of consecutive layers: used only when lead is 1 */
void af_warm_start(af_model *m, const int32_t *pair, const int32_t *count);
/* take the cost of planned prefetches that were not issued off the backlog */
void af_refund(af_model *m, double bytes);

#endif
