"""What this session's selected tests need: a module fixture launches only the jobs that a
selected test reads (`make test` and `make test-scale` select different parameters of one test)."""


def selected_values(request, test, param):
    """The values of ``param`` in the selected parameter sets of ``test`` (a function of the
    requesting fixture's module), sorted."""
    return sorted({item.callspec.params[param] for item in request.session.items
                   if item.module is request.module and item.originalname == test})


def is_selected(request, test):
    """Whether ``test`` (a function of the requesting fixture's module) runs in this session."""
    return any(item.module is request.module and item.originalname == test for item in request.session.items)
