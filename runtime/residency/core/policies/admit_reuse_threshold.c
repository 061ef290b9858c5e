/* reuse-threshold: decode admits a key once routed break_even times (its one parameter);
 * prefill always (admission.ReuseThreshold). */
#include "../core_impl.h"

static int admit(const rc_core *c, int32_t phase, int32_t f, const int32_t *victims,
                 int32_t nv) {
    (void) victims; (void) nv;
    if (phase == 0) return 1;
    const double break_even = c->pol.admission_params[phase][0];   /* its one parameter */
    return (double) total_uses(c, f) >= break_even;
}

RC_ADMISSION_POLICY(reuse_threshold, "reuse-threshold", .admit = admit);
