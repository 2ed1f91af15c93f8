"""What a headless run (``scripts/quickstart``, the docs build, the kernel tests) shows of a cell's
error: its type and message, and the notes IPython prints under them (the rank a launch's failure
came from), read from the error output as a real kernel writes it."""

from nbaccel.notebook.kernel.run_headless import output_text


def test_an_error_shows_its_message_and_the_notes_under_it():
    error = {
        "output_type": "error",
        "ename": "OSError",
        "evalue": "model foo/bar not found",
        "traceback": [
            "\x1b[36mCell\x1b[39m In[1], line 1\n----> 1 notebook_launcher(train)\n",
            "\x1b[31mOSError\x1b[39m: model foo/bar not found",
            "raised on rank 1",
            "stdin is not connected on the ranks",
        ],
    }
    assert output_text(error) == (
        "OSError: model foo/bar not found\nraised on rank 1\nstdin is not connected on the ranks\n"
    )


def test_an_error_without_notes_is_its_last_line():
    error = {
        "output_type": "error",
        "ename": "KeyError",
        "evalue": "'x'",
        "traceback": ["\x1b[31mKeyError\x1b[39m: 'x'"],
    }
    assert output_text(error) == "KeyError: 'x'\n"
    assert output_text({**error, "traceback": []}) == "KeyError: 'x'\n"
