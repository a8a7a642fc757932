from services.device_plugin.service import main

main()
