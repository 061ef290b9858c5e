/* always: a demand miss that found its victims is admitted (admission.Always). */
#include "../core_impl.h"

static int admit(const rc_core *c, int32_t phase, int32_t f, const int32_t *victims,
                 int32_t nv) {
    (void) c; (void) phase; (void) f; (void) victims; (void) nv;
    return 1;
}

RC_ADMISSION_POLICY(always, "always", .admit = admit);
