/* none: no prefetch (prefetch.NoPrefetch): no plan, the core skips the step. */
#include "../core_impl.h"

RC_PREFETCH_POLICY(none, "none", .plan = NULL);
