"""MLflow tracker against a real local MLflow file store (skipped where mlflow is not installed):
metrics, parameters (the caller's dict untouched, over-long values dropped), artifacts,
figures, and MLFLOW_NESTED_RUN read as a boolean -- as Accelerate documents them."""

import pytest


@pytest.fixture(scope="module")
def mlflow():
    """mlflow, imported when a test runs (it costs seconds of every collection otherwise)."""
    return pytest.importorskip("mlflow")


@pytest.fixture
def store(mlflow, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow 3 keeps file stores opt-in
    uri = "file://" + str(tmp_path / "mlruns")
    mlflow.set_tracking_uri(uri)
    yield uri, tmp_path
    if mlflow.active_run() is not None:
        mlflow.end_run()


def test_mlflow_run_records_metrics_params_and_files(mlflow, store):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from nbaccel import Accelerator
    from nbaccel.tracking import MLflowTracker

    uri, tmp_path = store
    tracker = MLflowTracker(experiment_name="exp", logging_dir=uri)
    accelerator = Accelerator(log_with=tracker)
    too_long = "x" * 100_000
    config = {"lr": 0.01, "too_long": too_long}
    accelerator.init_trackers("exp", config=config)
    assert config == {"lr": 0.01, "too_long": too_long}  # not mutated
    accelerator.log({"loss": 0.5, "note": "text"}, step=3)
    tracker.log({"acc": 1.0})  # step is optional
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "a.txt").write_text("a")
    tracker.log_artifact(tmp_path / "files" / "a.txt", artifact_path="one")
    tracker.log_artifacts(tmp_path / "files", artifact_path="many")
    tracker.log_figure(plt.figure(), artifact_file="fig.png")
    run_id = tracker.active_run.info.run_id
    accelerator.end_training()

    run = mlflow.get_run(run_id)
    assert run.data.metrics == {"loss": 0.5, "acc": 1.0}
    assert run.data.params == {"lr": "0.01"}
    listed = {a.path for a in mlflow.artifacts.list_artifacts(run_id=run_id)}
    assert {"one", "many", "fig.png"} <= listed


def test_nested_run_variable_is_a_boolean(store, monkeypatch):
    from nbaccel.tracking import MLflowTracker

    for value, expected in (("false", False), ("0", False), ("True", True), ("yes", True)):
        monkeypatch.setenv("MLFLOW_NESTED_RUN", value)
        assert MLflowTracker(experiment_name="exp", nested_run=not expected).nested_run is expected
