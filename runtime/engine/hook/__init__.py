"""The routing hook: llama.cpp's eval callback (``cb_eval``), which reads each MoE layer's
router output before its expert matmuls run and steps the residency consumers with it.

  route_hook.c / .h     the callback and its C API (rh_*): the ubatch framing, the events
  route_frame.h         the ubatch framing route_hook.c and route_impose.c share
  route_consumers.c     the one list of consumers: cores (rc_step), device caches (dc_route),
                        RAM tiers (rt_step), the Python observer adapter
  route_impose.c        imposed routing: the router's logits set from a trace
  route_hook_impl.h     the private struct of the files above
  c_hook.py             CHook, the C hook's Python side (the only live framing)
  config.py             HookConfig: the C hook's own description (layers, k, strict)
  events.py             RouteEvent, RouteObserver, RouteCaptureError: what both hooks hand out
  reference.py          the slow reference: RouteAssembler (the framing rules on arrays) and
                        RoutingHook (a Python cb_eval); tests compare the C hook against it
  residency_observer.py the Python feed of a manager running the reference core
  imposed_routing.py    ``--route-trace``: a trace's routing as route_impose.c consumes it

The package sits below the engine (tests/test_import_layers.py): the engine builds a hook and
frames each decode with it; nothing here imports the engine.
"""
