/* transient-on-pressure: admit unless the first victim was used within `window` accesses
 * (its one parameter; admission.TransientOnPressure). */
#include "../core_impl.h"

static int admit(const rc_core *c, int32_t phase, int32_t f, const int32_t *victims,
                 int32_t nv) {
    if (nv == 0) return 1;
    const double window = c->pol.admission_params[phase][0];      /* its one parameter */
    return (double) (c->last_seq[f] - c->last_seq[victims[0]]) > window;
}

RC_ADMISSION_POLICY(transient_on_pressure, "transient-on-pressure", .admit = admit);
