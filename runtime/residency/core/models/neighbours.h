/* neighbours: the token-neighbour vote of prefetch `affinity` (internal to the residency core).
 *
 * The pair table (affinity.h) predicts layer i + lead from layer i alone, averaged over every
 * token the model has seen. A token's routing at the layers it has already passed says much
 * more about which token it is: tokens routed alike at layers 0 .. i are routed alike after
 * (on the real traces, the top prediction among the keys not recently routed was right
 * 0.495 against 0.407 of the time on qwen3-30b-a3b at lead 2, 0.19 against 0.13 on
 * gpt-oss-120b at lead 5). So the model keeps the routing of the last NB_HISTORY tokens
 * (decode tokens and the prompt's, at every MoE layer; the token being scored is one of
 * them), and while a decode token passes its layers it scores each of them by the experts
 * they share, a layer's overlap weighing NB_DECAY less per layer-step after it:
 *     sim(t) = sum over the token's MoE layers j <= i of NB_DECAY^(i - j) |S_j ∩ X_t,j|
 * kept scaled by NB_DECAY^-i (the same order of tokens; no pass over every token per layer):
 * each shared expert adds inc[j] = (1 / NB_DECAY)^j, found in a per-(layer, expert) bitset of
 * the history slots routed there, so a layer-step costs its matches, not the history. S_j is
 * the scored token's first NB_WALK experts in routing order (the router's strongest), less
 * those more than NB_COMMON history tokens share at j (too common to tell tokens apart),
 * matched against every expert of the others: on the real traces matching all of them scored
 * no better (1.803x against 1.804x forced Belady), and a layer-step costs its matches. The
 * NB_K tokens of highest sim (ties: the newer) vote for layer i + lead:
 *     v(e') = sum over those t of sim(t) [e' in X_t,i+lead] / sum of their sim
 * (tokens with no routing recorded there do not vote). affinity's q is then
 *     (1 - NB_BLEND) q_table + NB_BLEND v(e')
 * (the vote alone where the table knows no source; affinity.c adds NB_BLEND / (sum of their
 * sim) times the sum, for the experts voted for only). Only one-token decode layer-steps are
 * scored (a layer-step at or before the previous one's MoE layer starts a new token); prompt
 * chunks (token-major, k per token) and a routing profile's last decode tokens join the
 * history token by token. Needs k (n_expert_used): with k = 0 there is no history. The
 * constants were chosen on the two real traces; the variants tried scored within 0.01x but
 * for a shorter history (32 or 64 tokens: 0.03x and 0.01x worse; docs/design/policy-study.md).
 * Operations are in the order of the Python reference (runtime/residency/reference/neighbours.py).
 */
#ifndef NEIGHBOURS_H
#define NEIGHBOURS_H
#include <stdint.h>

#define NB_HISTORY 128   /* tokens kept (a multiple of 64) */
#define NB_WORDS (NB_HISTORY / 64)
#define NB_K 2           /* tokens that vote */
#define NB_K_MAX 64      /* a prompt's or profile's token: its first distinct experts read */
#define NB_WALK 2        /* the scored token's experts matched, per layer: its strongest */
#define NB_COMMON 16     /* an expert held by more history tokens at a layer is not matched */
#define NB_DECAY 0.75    /* an earlier layer's overlap, per layer-step */
#define NB_BLEND 0.5     /* the vote's share of q */

typedef struct {
    int32_t n_moe, n_expert, k;
    int64_t n_tok;                /* token numbers handed out (slot of t: t % NB_HISTORY) */
    int64_t cur;                  /* the decode token being scored, -1 none */
    int32_t last_idx;             /* the MoE index of its latest layer-step */
    int64_t p_base;               /* the latest prompt chunk's first token, its size and */
    int32_t p_n, p_idx;           /* MoE index (a chunk at or before it starts new tokens) */
    int64_t *slot_t;              /* (H,) the token a slot holds, -1 none */
    int16_t *ex;                  /* (n_moe, H, k) its distinct experts at each layer, -1 pad */
    uint64_t *member;             /* (n_moe, E, NB_WORDS) bit h: slot h's token was routed to
                                     e at the layer */
    uint16_t *n_member;           /* (n_moe, E) how many slots the bitset holds */
    double *sim;                  /* (H,) scaled sim of each slot, for the token cur */
    double *inc;                  /* (n_moe,) (1 / NB_DECAY)^i */
    int32_t best[NB_K];           /* the voting slots, highest (sim, token) first */
    double best_s[NB_K];
    int64_t best_t[NB_K];
    int32_t n_best;
} nb_model;

/* NULL: out of memory, or no history possible (k < 1, n_moe < 1, ids past int16) */
nb_model *nb_create(int32_t n_moe, int32_t n_expert, int32_t k);
void nb_free(nb_model *m);
/* a decode layer-step of MoE index idx routed to the distinct experts d[nd] (one token) */
void nb_decode(nb_model *m, int32_t idx, const int32_t *d, int32_t nd);
/* a prompt chunk at MoE index idx: n elements, k per token, token-major */
void nb_chunk(nb_model *m, int32_t idx, const int32_t *el, int32_t n);
/* a profile's decode tokens join the history, oldest first: h (n, n_moe, hk) distinct experts
 * in routing order, -1 pad (the first k of each are kept) */
void nb_warm_start(nb_model *m, const int16_t *h, int32_t n, int32_t hk);
/* the vote for MoE index ti: each voting token's sim added to v[e] (v is 0 where no token
 * voted, and the caller zeroes what it got) for its experts there; the experts voted for
 * into voted[] (capacity NB_K * k), how many returned, the voters' sim summed into *tot */
int32_t nb_vote(const nb_model *m, int32_t ti, double *v, int32_t *voted, double *tot);

#endif
