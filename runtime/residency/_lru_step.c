/* _lru_step: the C version of runtime/residency/lru_step.py:lru_step (the reference; read its
 * docstring for the contract). It follows the Python function statement by statement and
 * works on the same Python objects, under the manager's lock and the GIL; tests compare both.
 *
 *   from _lru_step import lru_step
 *   tr, missed, evicted, freed = lru_step(core, flat_of, el, seq0, phase, b, free)
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define ABSENT 8

/* undo this call's misses (ExpertKeys in `missed`), then raise LookupError(e) */
static PyObject *bad_element(PyObject *state_obj, PyObject *od, PyObject *flat_of,
                             PyObject *missed, PyObject *e) {
    PyObject *exc_type, *exc_value, *exc_tb;
    PyErr_Fetch(&exc_type, &exc_value, &exc_tb);   /* a KeyError/TypeError, or none */
    Py_XDECREF(exc_type);
    Py_XDECREF(exc_value);
    Py_XDECREF(exc_tb);
    if (missed != NULL) {
        char *state = PyByteArray_AS_STRING(state_obj);
        Py_ssize_t n = PyList_GET_SIZE(missed);
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *expert = PyObject_GetAttrString(PyList_GET_ITEM(missed, i), "expert");
            if (expert == NULL) return NULL;
            PyObject *g = PyDict_GetItemWithError(flat_of, expert);   /* borrowed */
            Py_DECREF(expert);
            if (g == NULL) return NULL;
            state[PyLong_AsSsize_t(g)] = ABSENT;
            if (PyObject_DelItem(od, g) < 0) return NULL;
        }
    }
    PyObject *exc_args = PyTuple_Pack(1, e);            /* args == (e,), even for None */
    if (exc_args == NULL) return NULL;
    PyErr_SetObject(PyExc_LookupError, exc_args);
    Py_DECREF(exc_args);
    return NULL;
}

/* (tr, missed, evicted, freed) with new references to missed and evicted stolen */
static PyObject *result4(long tr, PyObject *missed, PyObject *evicted, long long freed) {
    PyObject *out = PyTuple_New(4);
    PyObject *tr_obj = PyLong_FromLong(tr), *freed_obj = PyLong_FromLongLong(freed);
    if (out == NULL || tr_obj == NULL || freed_obj == NULL) {
        Py_XDECREF(out);
        Py_XDECREF(tr_obj);
        Py_XDECREF(freed_obj);
        Py_DECREF(missed);
        Py_DECREF(evicted);
        return NULL;
    }
    PyTuple_SET_ITEM(out, 0, tr_obj);
    PyTuple_SET_ITEM(out, 1, missed);
    PyTuple_SET_ITEM(out, 2, evicted);
    PyTuple_SET_ITEM(out, 3, freed_obj);
    return out;
}

static PyObject *lru_step(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "lru_step takes 7 arguments");
        return NULL;
    }
    PyObject *core = args[0], *flat_of = args[1], *el = args[2];
    if (!PyTuple_Check(core) || PyTuple_GET_SIZE(core) != 7 || !PyDict_Check(flat_of)
            || !PyList_Check(el)) {
        PyErr_SetString(PyExc_TypeError, "lru_step: core tuple(7), flat_of dict, el list");
        return NULL;
    }
    PyObject *state_obj = PyTuple_GET_ITEM(core, 0), *last_obj = PyTuple_GET_ITEM(core, 1);
    PyObject *od = PyTuple_GET_ITEM(core, 2), *move = PyTuple_GET_ITEM(core, 3);
    PyObject *popitem = PyTuple_GET_ITEM(core, 4), *keys = PyTuple_GET_ITEM(core, 5);
    PyObject *nbytes = PyTuple_GET_ITEM(core, 6);
    if (!PyByteArray_Check(state_obj) || !PyList_Check(keys) || !PyList_Check(nbytes)) {
        PyErr_SetString(PyExc_TypeError, "lru_step: state bytearray, keys and nbytes lists");
        return NULL;
    }
    long long seq0 = PyLong_AsLongLong(args[3]);
    long phase = PyLong_AsLong(args[4]);
    long long b = PyLong_AsLongLong(args[5]);
    long long free_bytes = PyLong_AsLongLong(args[6]);
    if (PyErr_Occurred()) return NULL;

    Py_buffer view;
    if (PyObject_GetBuffer(last_obj, &view, PyBUF_WRITABLE) < 0) return NULL;
    if (view.itemsize != 8 || view.len != 8 * PyList_GET_SIZE(keys)) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_TypeError, "lru_step: last must be array('q'), one per key");
        return NULL;
    }
    long long *last = (long long *)view.buf;
    char *state = PyByteArray_AS_STRING(state_obj);
    Py_ssize_t n_flat = PyList_GET_SIZE(keys);

    long tr = 0;
    PyObject *missed = NULL;                 /* list of ExpertKeys, or NULL: all hit */
    PyObject *victims = NULL, *evicted = NULL, *result = NULL;
    long long seq = seq0;
    Py_ssize_t n = PyList_GET_SIZE(el);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *e = PyList_GET_ITEM(el, i);
        PyObject *f_obj = PyDict_GetItemWithError(flat_of, e);   /* borrowed */
        if (f_obj == NULL) {
            if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_TypeError)) goto fail;
            bad_element(state_obj, od, flat_of, missed, e);
            goto fail;
        }
        Py_ssize_t f = PyLong_AsSsize_t(f_obj);
        if (f < 0 || f >= n_flat) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_IndexError, "lru_step: flat key out of range");
            goto fail;
        }
        if (state[f] == ABSENT) {                       /* a demand miss */
            state[f] = (char)phase;
            if (PyObject_SetItem(od, f_obj, Py_None) < 0) goto fail;
            if (missed == NULL && (missed = PyList_New(0)) == NULL) goto fail;
            if (PyList_Append(missed, PyList_GET_ITEM(keys, f)) < 0) goto fail;
        } else {
            if (state[f] == 0) tr++;
            PyObject *r = PyObject_CallOneArg(move, f_obj);
            if (r == NULL) goto fail;
            Py_DECREF(r);
        }
        last[f] = seq;
        seq++;
    }
    if (missed == NULL) {                               /* all hit */
        PyObject *empty = PyTuple_New(0);
        if (empty == NULL) goto fail;
        Py_INCREF(Py_None);
        result = result4(tr, Py_None, empty, 0);
        goto done;
    }
    long long need = (long long)PyList_GET_SIZE(missed) * b - free_bytes;
    if (need <= 0) {
        PyObject *empty = PyTuple_New(0);
        if (empty == NULL) goto fail;
        PyObject *missed_t = PyList_AsTuple(missed);
        if (missed_t == NULL) {
            Py_DECREF(empty);
            goto fail;
        }
        result = result4(tr, missed_t, empty, 0);
        goto done;
    }
    /* the shortest prefix of the order that frees `need` bytes (see the reference) */
    victims = PyList_New(0);
    if (victims == NULL) goto fail;
    long long freed = 0;
    Py_ssize_t v = -1;
    PyObject *false_arg = Py_False;
    while (freed < need) {
        PyObject *item = PyObject_CallOneArg(popitem, false_arg);   /* (key, None) */
        if (item == NULL) goto fail;
        PyObject *v_obj = PyTuple_GET_ITEM(item, 0);
        v = PyLong_AsSsize_t(v_obj);
        int bad = (v < 0 || v >= n_flat || PyList_Append(victims, v_obj) < 0);
        Py_DECREF(item);
        if (bad) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_IndexError, "lru_step: victim out of range");
            goto fail;
        }
        freed += PyLong_AsLongLong(PyList_GET_ITEM(nbytes, v));
    }
    if (last[v] >= seq0) {                              /* too few unleased keys: put back */
        for (Py_ssize_t i = PyList_GET_SIZE(victims) - 1; i >= 0; i--) {
            PyObject *w = PyList_GET_ITEM(victims, i);
            if (PyObject_SetItem(od, w, Py_None) < 0) goto fail;
            PyObject *r = PyObject_CallFunctionObjArgs(move, w, Py_False, NULL);
            if (r == NULL) goto fail;
            Py_DECREF(r);
        }
        PyObject *missed_t = PyList_AsTuple(missed);
        if (missed_t == NULL) goto fail;
        Py_INCREF(Py_None);
        result = result4(tr, missed_t, Py_None, 0);
        goto done;
    }
    Py_ssize_t n_ev = PyList_GET_SIZE(victims);
    evicted = PyTuple_New(n_ev);
    if (evicted == NULL) goto fail;
    for (Py_ssize_t i = 0; i < n_ev; i++) {
        Py_ssize_t w = PyLong_AsSsize_t(PyList_GET_ITEM(victims, i));
        state[w] = ABSENT;
        PyObject *key = PyList_GET_ITEM(keys, w);
        Py_INCREF(key);
        PyTuple_SET_ITEM(evicted, i, key);
    }
    PyObject *missed_t = PyList_AsTuple(missed);
    if (missed_t == NULL) goto fail;
    result = result4(tr, missed_t, evicted, freed);
    evicted = NULL;                                     /* stolen by the result */
    goto done;

fail:
    result = NULL;
done:
    PyBuffer_Release(&view);
    Py_XDECREF(missed);
    Py_XDECREF(victims);
    Py_XDECREF(evicted);
    return result;
}

static PyMethodDef methods[] = {
    {"lru_step", (PyCFunction)(void (*)(void))lru_step, METH_FASTCALL,
     "lru_step(core, flat_of, el, seq0, phase, b, free) -> (tr, missed, evicted, freed); "
     "see runtime/residency/lru_step.py"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_lru_step", NULL, -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__lru_step(void) { return PyModule_Create(&module); }
