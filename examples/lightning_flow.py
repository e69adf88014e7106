"""examples/lightning_classifier.py trained by the ``train`` task in a flow of your own
(docs/how-to/lightning.md):

    PREFECT_ML_ALLOWED_MODULES=examples python -m examples.lightning_flow
"""

from prefect import flow

from prefect_ml import preprocess, train


@flow
def my_flow() -> str:
    data = preprocess(dataset="digits")
    run = train(
        data,
        model="examples.lightning_classifier:build",
        workers=2,
        epochs=6,
        early_stopping_patience=2,
        early_stopping_metric="val_acc",
        early_stopping_mode="max",
    )
    return run.run_id


if __name__ == "__main__":
    print(my_flow())
