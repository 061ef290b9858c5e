/* belady-bypass (offline): admit only if used again before the first victim
 * (admission.BeladyBypass). */
#include "../core_impl.h"

static int admit(const rc_core *c, int32_t phase, int32_t f, const int32_t *victims,
                 int32_t nv) {
    (void) phase;
    if (nv == 0) return 1;
    return c->next_use[f] < c->next_use[victims[0]];
}

RC_ADMISSION_POLICY(belady_bypass, "belady-bypass", .admit = admit);
