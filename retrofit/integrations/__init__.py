"""Where users already train and load: transformers' Auto classes, its Trainer (and TRL's), axolotl.

    retrofit.enable()                      # auto_classes: AutoModelForCausalLM / pipeline / PEFT / lm-eval by path
    Trainer(..., callbacks=[RetrofitCallback(recipe_section)])   # trainer: recovery schedules, length evaluation
    plugins: [retrofit.integrations.axolotl.RetrofitPlugin]      # axolotl: patch, calibrate, recover from its YAML

Each module imports the library it integrates with only where it is used; none of them is imported by retrofit's
own commands.
"""
